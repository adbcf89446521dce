"""The directives layer's name for the wire contracts of ``leyline_agent.edits``:
``Directive``, ``Mode``, ``MessageEdit``, ``plan_batch``, ``splice_tokens``. They live in a
root contract module so that ``wire``, ``trajectory`` and ``http_errors`` import nothing
above them; modules of this package and the layers above may import either name.
"""

from leyline_agent.edits import *  # noqa: F403  (the names of edits.__all__)
from leyline_agent.edits import __all__ as __all__
