"""Local stand-ins for services that cannot run on a development machine, named as fakes."""
