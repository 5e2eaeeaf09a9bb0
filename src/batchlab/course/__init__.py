"""The course around the lessons: your engine's pieces and their checkers.

``my_engine`` (the pieces you write, saved in ``my_engine/``, loaded fresh; its names are
this package's: ``course.setup``, ``course.piece``, ``course.choose``...), ``checks/`` (the
checkers), ``listing`` (library code shown in a lesson), ``exercises`` (learner copies from
the solved lessons) and ``lessons`` (``python -m batchlab.course.lessons``: your own copy).
"""

from .pieces import (  # noqa: F401 (the names lessons use: course.piece, course.choose...)
    HISTORY,
    PACKAGE,
    Missing,
    choose,
    earlier,
    is_stub,
    mine_or_reference,
    piece,
    setup,
    write_piece,
)
