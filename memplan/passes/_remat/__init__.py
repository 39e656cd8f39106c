"""The rematerialisation machinery that ``remat`` and ``timesteps`` share: the facts of a graph's
forward nodes, the min cuts, where copies go and how they are applied, and the simulation of a plan
without building it. See :mod:`memplan.passes.remat` for the stages."""
