"""The benchmarks of `kvgate bench`: the overload benchmark (workload, scoring, virtual and
live runs, report) and routings compared on shared-prefix traffic (`prefix`)."""
