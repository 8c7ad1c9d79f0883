"""The draft gate: the online acceptance estimator on every draft, and per-request trimming
(pure rules in ``loadwise.policy.{acceptance,gate,trim}``; ``engine`` runs in vLLM's engine core,
``worker`` in its model worker)."""
