"""Experts sharded over Ray actors (``--ray``): the driver runs the spine, workers hold the experts.

``provider.RayExperts`` implements the expert interface (``experts.interface``) by sending
each MoE layer's routed rows to expert workers (``worker.ExpertWorker``, Ray actors with their
own memory budget, cache, reader pool and model source) and folding their outputs in the
single process's order. Ray is the optional ``ray`` extra; it is imported only in this package,
and only when a cluster is used (``connect.require_ray``). See docs/scale-out.md.
"""
