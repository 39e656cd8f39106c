"""memplan's passes, one per module; importing this package registers them all.

Each module registers its pass with :func:`memplan.pipeline.register_pass` at import, following the
contract in :mod:`memplan.pipeline`: ``fn(graph, ctx) -> PassResult``. Modules whose names start with an
underscore are helpers, not passes.
"""

import importlib
import pkgutil

for _module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
