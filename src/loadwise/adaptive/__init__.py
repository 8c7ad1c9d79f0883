"""Adaptive draft-length tables: the live controller (``loadwise.policy.adaptive``) fed by the
engine's acceptance counts (``engine``, in vLLM's engine core)."""
