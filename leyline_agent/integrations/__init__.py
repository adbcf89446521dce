"""Adapters that route third-party agent frameworks through Leyline (debug-gym, ...)."""
