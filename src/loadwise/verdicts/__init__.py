"""Targets declared as data before the run, verdicts computed from result files: the targets
(``benchmarks/targets/*.toml``), the rules that judge a figure against a bound, the git history
that says whether a target was committed before the result it judges, and the tables
``loadwise report verdicts`` prints and writes into the docs."""
