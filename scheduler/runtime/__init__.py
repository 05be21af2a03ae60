"""Policies the runtime's mechanisms call while a run goes (RLinf sections 3.3 and 3.5): which
queued items a channel's consumer takes (:mod:`.balance`), which waiting worker a device lock
admits next (:mod:`.lock_order`).
"""
