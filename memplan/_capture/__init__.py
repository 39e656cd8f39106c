"""Private pieces of :mod:`memplan.capture`: the tracer that records the graph over fake tensors."""
