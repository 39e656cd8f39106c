"""Helpers of the chunk pass (:mod:`memplan.passes.chunk`), one concept per module.

- :mod:`.rules`: the chunk states and the per-op chunk rules (how an op carries the chunked index);
- :mod:`.graphs`: graph surgery shared with the rewrite pass (a region's backward, stable re-sorting,
  copies, fake values);
- :mod:`.loops`: loop bodies and :class:`~memplan.passes._chunk.loops.ChunkLoop`, the module that runs
  them chunk by chunk;
- :mod:`.cost`: the roofline cost model behind the policy's overhead estimate.

The package name starts with an underscore, so pass discovery (:mod:`memplan.passes`) skips it.
"""
