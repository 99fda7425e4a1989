"""Test helpers shared by the suites: private Redis servers, fixture models."""
