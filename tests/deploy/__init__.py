"""Tests of the deploy package."""
