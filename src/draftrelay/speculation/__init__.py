"""The speculation cache: round t+1 drafted during round t's verify, for the likely outcomes of round t.

`table`: the branch table (format, branch choice, exact-prefix selection), numpy only and importing
nothing else of the package, so the worker, the proxy and the engine all read the same format.
The other halves: `draftrelay.handoff.branch_shm` (the shared-memory slots the proxy writes tables
into and the engine reads them from), `draftrelay.handoff.branch_push` (the proxy's push),
`draftrelay.worker.prefetch` (the worker's branches), `draftrelay.engine.spec_cache` (the engine step).
"""
