"""The rewrite pass's parts: the machinery that replaces a forward region and its backward
(:mod:`~memplan.passes._rewrite.region`), and the region rewrites that live in their own modules."""
