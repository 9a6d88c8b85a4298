"""Meshes, logical-axis rules and sharded initialisation."""

from diffusiongemma.parallel.mesh import abstract_with_sharding
from diffusiongemma.parallel.mesh import batch_sharding
from diffusiongemma.parallel.mesh import BATCH_AXES
from diffusiongemma.parallel.mesh import init_params
from diffusiongemma.parallel.mesh import LOGICAL_RULES
from diffusiongemma.parallel.mesh import logical_rules
from diffusiongemma.parallel.mesh import make_mesh
from diffusiongemma.parallel.mesh import MESH_AXES
from diffusiongemma.parallel.mesh import mesh_shape
from diffusiongemma.parallel.mesh import param_shardings
from diffusiongemma.parallel.mesh import param_specs
from diffusiongemma.parallel.mesh import replicated

__all__ = ["BATCH_AXES", "abstract_with_sharding", "LOGICAL_RULES", "MESH_AXES", "batch_sharding", "init_params", "logical_rules",
           "make_mesh", "mesh_shape", "param_shardings", "param_specs", "replicated"]

from diffusiongemma.parallel.distributed import initialize_distributed  # pylint: disable=g-import-not-at-top
from diffusiongemma.parallel.distributed import is_main_process  # pylint: disable=g-import-not-at-top
from diffusiongemma.parallel.distributed import sync  # pylint: disable=g-import-not-at-top

__all__ += ["initialize_distributed", "is_main_process", "sync"]

from diffusiongemma.parallel import compilation_cache  # pylint: disable=g-import-not-at-top

define_compilation_cache_flag = compilation_cache.define_flag
enable_compilation_cache = compilation_cache.enable_compilation_cache

__all__ += ["define_compilation_cache_flag", "enable_compilation_cache"]
