"""Concrete LLM pieces and workers of m2flow (installed as ``m2flow.workers``).

The subpackages here are plain torch / transformers code with explicit inputs; the Ray worker
classes that wrap them live next to them and import them lazily so that importing
``m2flow.workers`` stays cheap.
"""
