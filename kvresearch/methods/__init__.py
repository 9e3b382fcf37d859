"""Compression methods: small objects built from config that write into the ragged cache."""
