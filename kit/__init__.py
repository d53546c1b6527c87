"""The kit: one LLM split over GPU notebooks behind NAT, joined by a relay, with speculative decoding."""
__version__ = "0.1.0"
