"""Entry points: the `runwarden` command and the dev stack it starts (not shared vocabulary: api/ and
workers/ never import this package)."""
