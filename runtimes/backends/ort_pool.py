"""ONNX Runtime's thread pools for tk's sessions: each session on a pool of its own, or, in a process that
opts in (the tk command), all of them on ONNX Runtime's process-wide pool, sized by the first runtime's
thread count. Apart from runtimes/backends/ort.py so that its CPU probes (ort_probes.py) ask it too."""

from __future__ import annotations

_SHARED_POOL: dict = {"wanted": False, "threads": None}  # ORT's own process-wide state, mirrored


def session_options(ort, threads: int | None = None, spin: bool = False, sizes_pool: bool = True):
    """SessionOptions for a tk session: full graph optimization, quiet, and on the process-wide
    pool when the process opted in (use_shared_thread_pool), else on a pool of its own, whose
    threads spin between kernels only with `spin` (a runtime with one session: no other pool's
    threads to take the cores from). Without `sizes_pool` (a CPU probe's session) it joins the
    process-wide pool only where a runtime already sized it, else it keeps a pool of its own."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    # Prefill and decode each have a session. With a thread pool each, the spinning threads of
    # one steal the cores the other needs (55M model, 2 cores: time to first token 57 ms).
    # Without spinning: 30 ms. Sharing ORT's process-wide pool is faster still (28 ms, and
    # decode 3.8 instead of 4.1 ms/token) but binds every ORT session in the process to it,
    # so only a process that is tk's own opts in (the tk command does).
    if _SHARED_POOL["wanted"] and (sizes_pool or _SHARED_POOL["threads"] is not None):
        if _SHARED_POOL["threads"] is None:
            ort.set_global_thread_pool_sizes(threads or 0, 1)  # 0: ORT chooses
            _SHARED_POOL["threads"] = threads or 0
        opts.use_per_session_threads = False
    else:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        if threads:
            opts.intra_op_num_threads = threads
    return opts


def use_shared_thread_pool() -> None:
    """Run every tk ORT session of this process on ORT's process-wide thread pool, sized by the
    first runtime's thread count. Call it before any ORT session exists, and only in a process
    where every ORT session is tk's: ORT then refuses sessions that keep a pool of their own."""
    _SHARED_POOL["wanted"] = True
