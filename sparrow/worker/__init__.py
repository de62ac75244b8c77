"""Runs the model for the scheduler's plans: batch building, sampling."""
