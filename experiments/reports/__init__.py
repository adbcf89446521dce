"""Recorded runs and the pages built from them (``leyline bench report``), and ``leyline demo``."""
