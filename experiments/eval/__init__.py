"""Agent evaluations (``leyline eval mini-nightmare``): debug-gym tasks, the endpoint, the run loop and its reports."""
