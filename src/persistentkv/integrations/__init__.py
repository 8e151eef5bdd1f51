"""Adapters into serving engines people use."""
