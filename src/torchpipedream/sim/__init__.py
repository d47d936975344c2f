"""Interpreting a schedule without torch: costs, the event simulator, traces, timeline pictures."""
