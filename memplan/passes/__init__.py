"""memplan's passes, one per module; importing this package registers them.

Each pass follows the contract in :mod:`memplan.pipeline`: ``fn(graph, ctx) -> PassResult``.
"""
