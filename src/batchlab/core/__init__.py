"""The engine being taught, in plain Python (no MLX: a test makes sure).

From the bottom up: ``request`` (a request's lifecycle, what it asks of its generation and its
sampler, and the checks a prompt must pass), ``runner`` (the interface the model side
implements, and the row sampling the real and fake runners share), ``kv`` (the block manager), ``trace`` and
``metrics`` (what happened, and the numbers it is judged by), ``policies`` (who goes first,
who waits, who is shed), ``costmodel`` (a pass's time predicted, the budget a target
allows), ``scheduler/`` (the base, with the ``Batch`` a kind plans, and the kinds), ``engine`` (submit / step / poll /
cancel), and ``fake`` (a model with known answers, for tests and checkers).
"""
