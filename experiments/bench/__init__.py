"""Benchmarks (``leyline bench ...``): speed, cost and soak runs that print ratios measured side by side."""
