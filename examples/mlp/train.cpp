// Trains the residual MLP of mlp.cppm on Fashion-MNIST with the shared remat trainer.
import remat.runtime;
import mlp;
import mlp.kernels;

int main(int argc, char **argv) {
  return remat::runtime::train_main(argc, argv,
                                    {.name = "mlp",
                                     .model = mlp::model,
                                     .default_policy = mlp::policy,
                                     .default_batch = mlp::default_batch,
                                     .kernels = mlp_kernels::table});
}
