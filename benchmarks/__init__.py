"""Side-by-side measurements that print JSON and a table (never asserted in tests)."""
