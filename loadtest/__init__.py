"""Load tester for mha-serving: an HTTP client like any other; imports nothing from service/ and never torch."""
