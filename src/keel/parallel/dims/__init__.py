"""The degrees of the layout beyond keel's own (pp, dp_replicate, dp_shard, tp), one module each: the module
declares its degree with `keel.parallel.degrees.degree` as it is imported, and every module of this package is
imported wherever the degrees or a config are wanted, so that a degree is added by its file alone. The modules
import no torch (a command checks a layout before torch is loaded): what a degree does to the model imports it
when called."""
