"""Policies the runtime's mechanisms call while a run goes (RLinf section 4): which queued items
a channel's consumer takes (:mod:`.balance`), which waiting worker a device lock admits next
(:mod:`.lock_order`).
"""
