# source: https://github.com/keras-team/keras/issues/11860 (adam does not work with FP16: loss nan)
# expect: NGL013 optimizer_numerics
from keras import backend as K
from keras.models import Sequential
from keras.layers import Dense

K.set_floatx('float16')


def build():
    model = Sequential([Dense(64, activation='relu'), Dense(1)])
    model.compile(loss='mse', optimizer='adam')
    return model
