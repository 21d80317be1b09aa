"""Reduced precision: tables (fp16/int8/int4 lookups) and the dense part (fp16/int8), and what accuracy it costs."""
