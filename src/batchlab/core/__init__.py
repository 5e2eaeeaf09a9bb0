"""The engine being taught, in plain Python (no MLX: a test makes sure).

From the bottom up: ``request`` (a request's lifecycle, and the checks a prompt must pass),
``sampling`` (logits to a token), ``batch`` (one pass, in the scheduler's words), ``runner``
(the interface the model side implements), ``kv`` (the block manager), ``trace`` and
``metrics`` (what happened, and the numbers it is judged by), ``policies`` (who goes first,
who waits, who is shed), ``costmodel`` (a pass's time predicted, the budget a target
allows), ``scheduler/`` (the base and the kinds), ``engine`` (submit / step / poll /
cancel), and ``fake`` (a model with known answers, for tests and checkers).
"""
