"""Re-export of ``kvstate.models.tiny`` (the tiny models moved to production for ``--model tiny:<type>``)."""

from ..models.tiny import (
    CONFIGS,
    GEMMA3_BOI,
    GEMMA3_EOI,
    GEMMA3_IMAGE,
    IMAGE_TEXT,
    IMAGE_TOKEN,
    QWEN_VL,
    RECURRENT,
    SLIDING,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    WINDOW,
    gemma3_image,
    image_span,
    tiny_config,
    tiny_image,
    tiny_model,
    tiny_prompt,
    tiny_video,
    video_span,
)

__all__ = ["CONFIGS", "GEMMA3_BOI", "GEMMA3_EOI", "GEMMA3_IMAGE", "IMAGE_TEXT", "IMAGE_TOKEN", "QWEN_VL", "RECURRENT",
           "SLIDING", "VIDEO_TOKEN", "VISION_END", "VISION_START", "WINDOW", "gemma3_image", "image_span",
           "tiny_config", "tiny_image", "tiny_model", "tiny_prompt", "tiny_video", "video_span"]
