"""Programs shipped beside the library, never imported by it: the benchmarks
(``quicksave bench``), the demo (``quicksave demo``) and the servers the tests start
(:mod:`quicksave_tools.testing`). The layering test holds the library to that."""
