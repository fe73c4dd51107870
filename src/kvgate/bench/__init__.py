"""The overload benchmark: workload, scoring, virtual and live runs, report."""
