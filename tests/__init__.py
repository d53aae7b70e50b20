"""elrun's tests; tests.support is their support library (//tests/support)."""
