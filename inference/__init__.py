"""Client inference backends: every way a client infers its local posterior."""
from fedprob.protocols import ClientBackend, ClientResult
from .nuts import HMC, NUTS
from .laplace import Laplace
from .optim import minimize
from .sgld import SGLD
from .sghmc import SGHMC
from .cyclical_sghmc import CyclicalSGHMC
from .sgnht import SGNHT
from .iasg import IASG
from .svi import SVI
from .ivon import IVON, IVONInputs, IVONState, ivon_init, ivon_solve, ivon_step
from .von import VON

from fedprob.names import module_getattr as _module_getattr

__getattr__ = _module_getattr(__name__, globals(), "client backend or attribute")
