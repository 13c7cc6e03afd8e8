"""The check-run step: every run parameter checked before anything is staged or trained."""
