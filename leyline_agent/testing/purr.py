"""debug-gym's ``purr`` task, as the tests script it (the dataset ships in debug-gym's wheel)."""

__all__ = ["PURR_FIX"]

# The purr bug: the `> 10` branch shadows the `> 20` one (lines 27-32 of purr_code.py).
PURR_FIX = (
    "        if self.hunger > 20:\n"
    "            result = self.intense_meow()\n"
    '            self.feed("meat")\n'
    "        elif self.hunger > 10:\n"
    "            result = self.meow()\n"
    '            self.feed("fish")'
)
