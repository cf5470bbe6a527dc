"""Fault-injection tests: killed processes, a lost Redis, a shaped or cut network (slow)."""
