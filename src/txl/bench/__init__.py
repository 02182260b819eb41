"""`txl bench`: reproducible speed and memory measurements (issue 6).

Each benchmark is a module named in `txl.cli.bench.BENCHES` that provides

    TITLE: str
    run(options: txl.bench.common.BenchOptions) -> dict   # JSON-ready, with a "rows" list
    table(result: dict) -> str                           # a markdown table of the rows

and `txl bench all` (`txl.bench.report`) runs them all and writes docs/results/benchmarks.md with plots.
"""
