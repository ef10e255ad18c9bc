"""Shared test aids: fakes, harnesses and process wrappers the test folders import as `support.*`."""
