"""One file per model family; each owns its block and router."""

from moefit.models.deepseek_v3 import DeepseekV3
from moefit.models.glm4_moe import Glm4Moe
from moefit.models.gpt_oss import GptOss
from moefit.models.mixtral import Mixtral
from moefit.models.olmoe import Olmoe
from moefit.models.qwen3_5_moe import Qwen3_5Moe
from moefit.models.qwen3_moe import Qwen3Moe
from moefit.models.qwen3_next import Qwen3Next

FAMILY = {"qwen3_moe": Qwen3Moe, "mixtral": Mixtral, "olmoe": Olmoe, "glm4_moe": Glm4Moe,
          "qwen3_5_moe": Qwen3_5Moe, "qwen3_next": Qwen3Next,
          "deepseek_v3": DeepseekV3, "gpt_oss": GptOss,
          "glm4_moe_lite": DeepseekV3}    # GLM-4.7-Flash: DeepSeek-V3's forward; only its MoE layers differ
