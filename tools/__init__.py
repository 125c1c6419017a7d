"""Maintenance programs (training the embedded model, data generation). Not part of the installed app."""
