"""Test utilities that ship with mmrl, so a user's own policy or reward can run the same checks."""
