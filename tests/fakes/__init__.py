"""Stand-ins for services that cannot run on the development machines (named fakes)."""
