"""Placeholder until engine.plan lands."""
