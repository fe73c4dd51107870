"""The overload benchmark (issue 6): workload, scoring, virtual and live runs, report."""
