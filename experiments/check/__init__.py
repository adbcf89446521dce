"""Correctness and quality reports (``leyline check ...``): what a splice changes in what a model says."""
