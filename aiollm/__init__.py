"""aiollm: an asyncio actor framework for disaggregated LLM serving (DistServe + FastDecode)."""

__version__ = "0.1.0"
